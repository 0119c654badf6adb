"""Which run keys a resume may change and which leave a configuration the same (run directories,
reports and plot labels read them; a leaf of the run layer, so plots need not import rundir)."""

# Keys a resumed run may change: they decide how long it runs, what it logs, where it reads data
# from and what happens on a NaN, never the numbers a round computes (rounds run bit-identically
# whatever the chunking of rounds into compiled calls).
RESUMABLE_KEYS = frozenset(
    {
        "rounds",
        "eval_every",
        "rounds_per_call",
        "member_chunk",
        "client_state",  # host-held client states give the same numbers as device-held ones
        "checkpoint_every",
        "keep_checkpoints",
        "nonfinite",
        "data_dir",
        "download",
        "plugins",  # where the algorithm's code is found (a moved file); its name and options are compared
    }
)
# Keys a resume may change at the cost of bit-identity: the devices the clients are split over. A
# run resumed on another device count (these keys, or the devices a machine shows) matches the run
# left alone to float tolerance, and says so (jaxfed.runs.rundir.warn_other_devices).
DEVICE_KEYS = frozenset({"devices", "host_devices"})
# Keys in which runs may differ and still be one configuration (the seeds of a ``jaxfed report``
# variant; never worth a plot label): besides the resumable keys but ``rounds``, the devices and
# the chunking of clients and evaluation batches (these may change float rounding, so a resume
# keeps them) and the plugins imported.
NEUTRAL_KEYS = (RESUMABLE_KEYS - {"rounds"}) | DEVICE_KEYS | {"client_chunk", "eval_batch_size", "plugins"}
