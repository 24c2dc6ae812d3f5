"""Wire format: message types, msgpack codec, tensor descriptors, shared-memory arena, socket helpers."""
