"""Weight publication from the trainer to the generation servers.

``bucket`` (plan, flatten, unflatten; pure), ``group`` (the process group of trainer rank 0 and the servers),
``sender`` (trainer rank 0), ``receiver`` (a server), ``disk`` (snapshot manifests), ``publisher`` (the
controller: ``publish(version) -> stats`` per ``weight_update_mode``).
"""
