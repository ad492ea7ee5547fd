"""omnistage.streaming"""
