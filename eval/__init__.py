"""segment.eval"""
