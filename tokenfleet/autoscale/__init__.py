"""Elastic replicas: a controller keeps each model's schedulers between a minimum and a maximum.

    policy.py      the decision alone (pure: signals in, desired replicas out), unit-tested
    signals.py     what the decision reads from Redis: queue depth and age, heartbeats
    launcher.py    how a replica starts and stops: a scheduler process, its Ray placement group
    controller.py  the loop: read, decide, launch or drain, publish tf:replicas:{model}
"""
