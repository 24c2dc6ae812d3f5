"""The MODELLED RK3588 board: every figure derived from the reference board's (cost.toml, each cited), for x86 runs.

    cost      the cost model: per-branch phase times and per-context memory for a model shape (BoardModel, Shape)
    timeline  the analytic critical path of one computed step under a lifecycle policy
    auto      the `auto` policy chooser: every policy that fits the board's memory, evaluated on the timeline
    pace      real work, then sleep to modelled x time_scale (the board-sim backend, the scheduler's host ops)
    account   per-step rows of board time, the 20-step projection, the tables of the benches and the job report

The board-sim backend that runs on this model is models/runtime/backends/board_sim.py.
"""
