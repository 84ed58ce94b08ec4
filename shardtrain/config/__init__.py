"""The one typed config: flags, YAML and the SageMaker environment in, validated settings out.
The bottom layer: it imports nothing else of shardtrain.
"""
