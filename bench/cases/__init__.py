"""The cases: sizes and routings, the programs of each implementation, the GShard baseline, the model presets, the NumPy reference."""
