"""Keeping a run alive and stopping it cleanly: the hang watchdog, the wall-clock time limit,
start-up checks of output directories, one-line exits for user errors, and the rerun /
fault-tolerance machinery.
"""
