"""Launching `specdec serve`: the checks before Ray (`preflight`), the parent/child processes
(`supervisor`), the local Ray cluster (`ray_start`, `reaper`), the pairs' actors (`placement`,
`services`) and the ports. Built on the config and the serving core."""
