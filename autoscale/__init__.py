"""SmartSpec-style goodput control: latency models, speculation length choice, and (later) drafter autoscaling."""
