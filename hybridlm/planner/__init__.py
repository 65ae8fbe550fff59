"""The memory planner: per-GPU bytes of a layout (``memory``), candidate layouts and the
recommendation (``search``), the command-line report (``report``), and the measurement the
figures are checked against (``measure``)."""
