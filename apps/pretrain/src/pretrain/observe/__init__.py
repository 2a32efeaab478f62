"""What a run shows about itself: step timing, metrics and MFU, profiler traces and plots."""
