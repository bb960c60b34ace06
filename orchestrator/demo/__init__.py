"""`specdec demo`: a small pair trained on this machine (`models` builds and caches it,
`training` trains it, both on the shapes and budget of `budget`), served by the orchestrator
and queried (`run`)."""
