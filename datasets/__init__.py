"""segment.datasets"""
