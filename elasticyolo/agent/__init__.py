"""The per-node daemon (`elasticyolo agent`): registry, election, state machine, plug-ins.

Never imports torch or ultralytics: workers are separate processes.
"""
