"""Engine-side code: runs inside the ipyparallel engines, one per rank.

It receives only plain data (dicts, strings, numbers) from the notebook kernel.
"""
