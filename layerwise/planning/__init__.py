"""Planning: what streams where, decided once before packing."""
