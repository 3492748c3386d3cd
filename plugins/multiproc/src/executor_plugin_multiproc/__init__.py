"""executor-plugin-multiproc (work in progress: declares no backend yet)."""

__all__: list[str] = []
