"""The data pipeline on Spark (issue 9): the log as a data source, and the jobs.

`gateway.spark.logfiles` plans and reads the embedded log's files without
Spark; `gateway.spark.source` is the PySpark data source ``msggateway``
over it; `gateway.spark.jobs` holds ``msggateway spark archive|report|send``.
Only the last two import PySpark, so the gateway itself never needs it.
"""
