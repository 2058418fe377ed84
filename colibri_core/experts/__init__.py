"""Experts: expert-set snapshots (expertset), hot-plug changes into them (expertchanges),
what stays resident and the budget's expert cache (residency, expertcache), and hot-plugged
.so experts (hotplug/)."""
