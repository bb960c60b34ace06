"""`specdec demo`: a small pair trained on this machine (`models`, `training`), served by the
orchestrator and queried (`run`)."""
