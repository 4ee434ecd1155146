"""The cost model: the layer's time per pass and per world size, predicted before it runs, and the
calibration that measures a machine for it. The command is `python -m tpattn.plan` (or
`python -m tpattn.model`, the same).

    errors.py     MachineError, ModelError, PlanError and the exit statuses
    steps.py      the layer as steps: Shape, Step, layer_steps, the collectives a call runs
    machine.py    machine files (machines/*.json or any path): Machine, load_machine, validate_machine
    costmodel.py  pricing: roofline x calibrated efficiency, alpha-beta collectives; predict, plan
    measure.py    timing on a GPU, shared by --calibrate and scripts/model/validate_model.py
    calibrate.py  --calibrate: measure this machine, build_machine writes the machine file
    cli.py        the command line: parser, table, JSON, plot, main

Everything but measure.py and calibrate.py is pure Python (no GPU needed).
"""
