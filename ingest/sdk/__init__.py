"""The producer SDK: what rollout code (a worker, a Miles rollout function) calls to publish
trajectory events to Kafka."""
