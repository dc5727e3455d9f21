"""segment.models"""
