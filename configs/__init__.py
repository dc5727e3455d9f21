"""segment.configs"""
