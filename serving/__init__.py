"""omnistage.serving"""
