"""How the replicas of a shared-mode gateway share state through Redis: the batching client
every script call goes through, pub/sub subscriptions, and the feeds (periodic passes and
subscribers) that carry each part's figures between the replicas."""
