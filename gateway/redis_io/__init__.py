"""The Redis client as every shared-mode part uses it: the batcher every script call goes
through, and pub/sub subscriptions that give their connection back. Below the ledger, the
limiter and the feeds, which all use it; it knows none of them."""
