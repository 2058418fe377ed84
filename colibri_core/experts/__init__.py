"""Experts: expert-set snapshots (expertset), expert changes into them, the engine's side
(expertchanges), what stays resident and the budget's expert cache (residency,
expertcache), and hot-plugged .so experts (hotplug/)."""
