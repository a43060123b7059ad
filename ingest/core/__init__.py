"""The pure core: group assembly, filters, advantages, metrics and batch sealing.

No module here imports Kafka, Delta or HTTP, so replay and unit tests drive it directly.
"""
