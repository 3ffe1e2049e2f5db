"""PySpark reconciliation and model-comparison jobs."""
