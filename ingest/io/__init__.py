"""I/O shared by the processor, the gateway, the trainer and the commands: the Delta lake,
Kafka clients and settings, the embedded broker, the events-archive reader and live tails."""
