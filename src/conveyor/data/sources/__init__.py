"""Dataset sources: where elements come from (ranges, in-memory arrays, generators, files)."""
