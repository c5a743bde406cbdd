"""Planning a run without torch: Config, parallel degrees, the memory estimator and code generation."""
