"""elasticyolo: elastic, fault-tolerant YOLO training on spot clusters."""
__version__ = "0.1.0"
