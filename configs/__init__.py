"""Run configs shipped with Colibri (installed as the package colibri_core.configs)."""
