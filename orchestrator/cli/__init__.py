"""The `specdec` command (`main`): `serve`, `generate` and `demo` (`orchestrator.demo.run`)."""
