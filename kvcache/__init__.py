"""Content-addressed KV block tiers: host RAM (LRU), a shared store (Redis, local disk), and the block
codec (versioned header + checksum). Moves and checks bytes; knows nothing of attention."""
