"""The serving core of `specdec serve`: each pair's hub stream (`pair`), admission and routing
(`scheduler`), every request's committed tokens and text (`records`, `requests`,
`detokenizer`), the calls in flight shared by both client APIs (`frontend`), the gRPC API
(`servicer`) and the metrics. It imports nothing else of the orchestrator, nor Ray."""
