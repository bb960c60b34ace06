"""The Ray orchestrator (admission, request order, committed tokens, the client API, metrics).

Not built yet: no issue has asked for it. It must import without torch or Triton (STYLE.md
habit 7); `specdec.serving.pipeline` is the draft -> target driver it will schedule.
"""
