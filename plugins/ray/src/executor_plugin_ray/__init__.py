"""executor-plugin-ray (work in progress: declares no backend yet)."""

__all__: list[str] = []
