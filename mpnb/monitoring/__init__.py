"""Memory monitoring: the side channel from the engines, the store, charts, reports and the dashboard comm."""
