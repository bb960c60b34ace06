"""The `specdec` command (`main`): `serve` (`serve`: its flags, its config, the orchestrator's
process), `generate` (`generate`) and `demo` (`orchestrator.demo.run`)."""
