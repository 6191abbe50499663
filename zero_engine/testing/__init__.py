"""Measuring tools for tests and benchmarks (not used by training): `DeviceGuard`, which makes
a CPU run fail where a GPU run would mix host and device tensors, and `process_memory`, memory
as the process holds it."""
