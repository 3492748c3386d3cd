"""A plugin whose import fails, as one with a missing dependency would."""

import executor_fixture_missing_dependency  # noqa: F401  # type: ignore[import-not-found]
