"""The per-node daemon (`elasticyolo agent`): registry, election, state machine, hooks.

Never imports torch or ultralytics: workers are separate processes.
"""
