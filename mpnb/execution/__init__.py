"""Running a cell on ranks: submission, live output, failure supervision and the final report."""
