"""Running simulations: a config, what it builds, its run directory, the loop, sweeps, processes.

The layer between the command line and the engine. ``config`` (run-level keys plus the chosen
algorithm's options), ``build`` (config -> Simulation), ``rundir`` and ``checkpoint`` (the run
directory: records, run checkpoints, resume), ``fingerprint`` (what a simulation is: recorded in
each checkpoint and compared on resume, described in ``config.json``), ``driver`` (the loop),
``sweep`` (members in one program), ``distributed`` (processes and host devices), ``memory``
(refusing what cannot fit), ``plots`` (the PNGs a run directory gets), ``results`` (run
directories read back as records for a table).
"""
