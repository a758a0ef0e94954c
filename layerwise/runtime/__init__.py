"""The runtime of a streamed layer group: the group, its host store, slot ring, meter and hooks."""
