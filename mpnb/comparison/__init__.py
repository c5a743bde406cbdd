"""`mpnb.compare` and `%%compare`: one training cell under several configs, measured side by side.

`specs` reads the configs, `runner` runs them on the cluster (the engine half is
`mpnb.engine.measure`), `result` holds the table and verdict, `chart` draws it.
"""
