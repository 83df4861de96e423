"""Fake TopsRider tops_extension (closed source; only imported before torch_gcu)."""
