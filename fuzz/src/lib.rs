//! Model-based fuzz targets live in `tests/`.
