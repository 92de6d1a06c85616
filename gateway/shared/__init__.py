"""How the replicas of a shared-mode gateway share state through Redis: the feeds (periodic
passes and subscribers) that carry each part's figures between the replicas, over the
batching client and pub/sub of gateway/redis_io/."""
