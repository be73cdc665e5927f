"""The `cosine` commands, one module per command group, each with its parser (`add_parser`) beside its handlers.

Handlers import what they run inside themselves (torch, transformers, Ray, the benchmarks): those take seconds to
import, and `cosine --help` or any other command should not wait for them."""
