"""The allocator's device tables: block tables, the fused table writes and translation, a
decode step's lookups in one launch, page copies, and their torch references (``ref``)."""
