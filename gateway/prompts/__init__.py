"""Prompt serving, in four rooms: `cursor` (the pure order: `Cursor`, `take`,
`roll_forward`), `wal` (the `group_started` events read back from Kafka), `checkpoints`
(the cursors in Delta) and `service` (`PromptService`: queues, group commit, restore)."""
